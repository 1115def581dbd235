"""``gather_or_cancel``: run awaitables concurrently; the first error stops the others."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable
from typing import Any

__all__ = ["gather_or_cancel"]


async def gather_or_cancel(awaitables: Iterable[Awaitable[Any]]) -> list[Any]:
    """Their results in order; when one raises (or the caller is cancelled), the others are cancelled and waited
    for before the error goes on, so no judge or reward call keeps running, and paying, after its group failed.

    Not ``asyncio.TaskGroup``: it raises an ``ExceptionGroup``, and callers here promise the error itself.
    """
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
