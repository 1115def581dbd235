"""Which event loop of this process serves each port it listens on (the gateway's, ``art-core serve``'s).

A synchronous HTTP call made on the thread of the loop that serves its server can never be answered: the call
blocks that thread, and the server runs on it. The adapters' routing layer asks ``loop_serving(port)`` before a
synchronous call to the gateway, to name that mistake at once instead of hanging until the client's timeout.
Plain and import-light: the adapters import it on the client side too, where no server runs.
"""

from __future__ import annotations

import asyncio
import threading
import weakref

__all__ = ["forget", "loop_serving", "serving"]

_lock = threading.Lock()
_loops: dict[int, weakref.ref[asyncio.AbstractEventLoop]] = {}


def serving(port: int, loop: asyncio.AbstractEventLoop) -> None:
    """Note that ``loop`` serves ``port`` (until ``forget``)."""
    with _lock:
        _loops[port] = weakref.ref(loop)


def forget(port: int, loop: asyncio.AbstractEventLoop) -> None:
    """``port`` is no longer served by ``loop`` (kept if another loop took it over since)."""
    with _lock:
        ref = _loops.get(port)
        if ref is not None and ref() in (loop, None):
            del _loops[port]


def loop_serving(port: int | None) -> asyncio.AbstractEventLoop | None:
    """The loop of this process that serves ``port``, or None (not served here, or no port)."""
    if port is None:
        return None
    with _lock:
        ref = _loops.get(port)
    return ref() if ref is not None else None
