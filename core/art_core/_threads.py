"""Threads of the library's own, for the blocking work that serving and training wait on.

``asyncio.to_thread`` (and ``run_in_executor(None, ...)``) run on the event loop's default executor, one pool of
``min(32, cores + 4)`` threads shared with the user's code: LangGraph runs every synchronous node there, the
Agents SDK every synchronous function tool. A node that calls the trainable model holds its thread until the
gateway answers. Were the engine's decode loop to need a thread of that same pool, six such nodes on a 2-core
machine would hold all of it, waiting for answers that no thread is left to compute. So whatever the gateway,
an engine or a training step needs in order to make progress runs on threads of its own, named for their job:

    decode = OwnThreads("art-decode")                      # one engine's decode loop: one thread owns the model
    outputs = await decode.run(engine.decode, batch)
    decode.close()                                         # with the engine

    tokenizer = await HELPERS.run(AutoTokenizer.from_pretrained, folder)   # short jobs: loads, schema compiles
    metrics = await TRAINING.run(trainer.train_step, groups, config)      # training steps, trainer loads

Work sent here must never wait for the user's code (or for other work queued on the same threads), or the
hazard comes back one level down. Threads start on first use: importing this module starts none.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from .errors import ConfigError, LifecycleError

__all__ = ["HELPERS", "TRAINING", "OwnThreads"]

T = TypeVar("T")


class OwnThreads:
    """A named pool of at most ``size`` threads, awaited like ``asyncio.to_thread``.

    Args:
        name: the threads' name prefix (``art-decode_0``...), as thread dumps and profilers show them.
        size: the most threads it runs at once; more work waits for one to be free. Default: 1 (the work is
            serialised, e.g. everything that touches one engine's model).

    Raises:
        ConfigError: ``size`` is below 1.
    """

    def __init__(self, name: str, *, size: int = 1) -> None:
        if size < 1:
            raise ConfigError(f"OwnThreads {name!r} got size={size}: give at least 1 thread")
        self.name, self.size = name, size
        self._pool = ThreadPoolExecutor(max_workers=size, thread_name_prefix=name)
        self._closed = False

    def __repr__(self) -> str:
        return f"OwnThreads({self.name!r}, size={self.size}{', closed' if self._closed else ''})"

    async def run(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on one of these threads, in a copy of the caller's context variables.

        Cancelling the caller stops waiting, not ``fn``: a thread cannot be interrupted (as with ``to_thread``).

        Raises:
            LifecycleError: the pool was closed.
        """
        if self._closed:
            raise LifecycleError(f"the {self.name!r} threads are closed: their owner was closed")
        call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._pool, call)

    def close(self) -> None:
        """Refuse new work and drop queued work; work already running finishes in the background."""
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)


HELPERS = OwnThreads("art-helper", size=4)
"""Short jobs of the library's own: loading models and tokenizers, compiling a request's JSON schema."""

TRAINING = OwnThreads("art-train", size=2)
"""Training steps and trainer loads (two, so that two models of one process can step at once)."""
