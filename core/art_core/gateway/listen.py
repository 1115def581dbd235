"""Serving an ASGI app with uvicorn inside the caller's event loop, on a socket bound first: what the gateway
(``Gateway.start``) and ``art-core serve`` (``server/run.py``) both do, written once.

    sock = bind(host, port, fix="pick another port")     # port 0 yields the real port at once
    server, task = await start_server(app, sock, failed=lambda error: LifecycleError(...))
    ...
    server.should_exit = True; await task

Binding first turns a port in use into a ``ConfigError`` (uvicorn would ``sys.exit``); the server leaves signal
handling to the host program.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn

from .. import _served_loops
from ..errors import ConfigError

__all__ = ["EmbeddedServer", "bind", "start_server"]


class EmbeddedServer(uvicorn.Server):
    """uvicorn's server without its signal capture."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn would take over SIGINT/SIGTERM and re-raise them after shutdown; the host program owns them.
        yield


def bind(host: str, port: int, *, fix: str) -> socket.socket:
    """A listening-ready TCP socket on ``host:port`` (port 0: a free one).

    Raises:
        ConfigError: the address cannot be resolved or bound; the message ends with ``fix``.
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise ConfigError(f"cannot listen on {host}:{port}: {exc}; check the host name") from exc
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc}; {fix}") from exc
    return sock


async def start_server(app: Any, sock: socket.socket, *, failed: Callable[[BaseException | None], Exception],
                       **config: Any) -> tuple[EmbeddedServer, asyncio.Task[None]]:
    """Serve ``app`` on ``sock`` in the running loop; returns once it accepts connections.

    Args:
        app: the ASGI app.
        sock: a socket from ``bind``.
        failed: the error to raise when the server stops before it starts, given uvicorn's error (or None).
        config: ``uvicorn.Config`` settings over the defaults below.
    """
    options: dict[str, Any] = dict(
        log_level="warning",
        log_config=None,  # leave the host program's logging configuration alone
        access_log=False, lifespan="off",
        timeout_graceful_shutdown=30,  # on close, in-flight generations and streams get this long to finish
        # Longer than clients keep idle connections (httpx: 5 s, aiohttp: 15 s), so the client always closes
        # first. uvicorn's 5 s default races with them: a request sent on a pooled connection as the server
        # closes it is lost, and after the host blocked the loop for a while, every idle connection's timer
        # fires at once (seen: 4 of 8 requests hung until the client timeout).
        timeout_keep_alive=75,
    )
    server = EmbeddedServer(uvicorn.Config(app, **{**options, **config}))
    task = asyncio.create_task(server.serve(sockets=[sock]), name="art-uvicorn")
    loop, port = asyncio.get_running_loop(), sock.getsockname()[1]
    _served_loops.serving(port, loop)  # a sync call to this port from this loop's thread would hang: _routing.py
    task.add_done_callback(lambda _: _served_loops.forget(port, loop))
    while not server.started:
        if task.done():
            error = task.exception() if not task.cancelled() else None
            raise failed(error) from error
        await asyncio.sleep(0.005)
    return server, task
