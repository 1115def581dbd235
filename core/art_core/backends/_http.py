"""``LoopClient``: one pooled ``httpx.AsyncClient`` for the event loop that uses it, for the HTTP clients of the
backend contract (``RemoteBackend``, a Ray rollout worker's ``GatewayView``).

An ``AsyncClient``'s pooled connections belong to the loop they were opened on. These clients are used from the
rollouts' loop, and now and then from another one (``TrainableModel.rollout_records`` waits on a loop of its
own): that other loop gets a one-off client, closed after the call, and the pool stays the main loop's.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx

__all__ = ["LoopClient"]


class LoopClient:
    """Hands out an ``httpx.AsyncClient`` built with ``options`` (see the module docstring).

    Args:
        options: ``httpx.AsyncClient`` keyword arguments (headers, timeout, ``trust_env``...).
    """

    def __init__(self, **options: Any) -> None:
        self.options = options
        self._client: httpx.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @asynccontextmanager
    async def client(self) -> AsyncIterator[httpx.AsyncClient]:
        """The pooled client on the loop that first asked; a one-off client on any other loop."""
        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is None or self._loop.is_closed():
            self._client, self._loop = httpx.AsyncClient(**self.options), loop
        if self._loop is loop:
            yield self._client
            return
        async with httpx.AsyncClient(**self.options) as once:
            yield once

    async def aclose(self) -> None:
        """Close the pooled client (call it on the loop that used it)."""
        client, self._client = self._client, None
        if client is not None and self._loop is asyncio.get_running_loop():
            await client.aclose()
