"""Train calls that outlive their HTTP request: idempotent by id, re-attachable, each trained at most once.

A train call becomes a ``TrainJob`` that runs as its own task, so a client that drops mid-step does not stop
it. Its events (progress, then the result or the error) are kept; anyone who asks with the same id gets them
from the start and follows until the end. A finished call's last event is also written to
``<model_dir>/train_calls/<id>.json``, so the same id is answered, not trained again, after a server restart.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ArtError, ConfigError

__all__ = ["TrainJob", "TrainJobs"]

logger = logging.getLogger(__name__)

Event = tuple[str, dict[str, Any]]
Run = Callable[[Callable[[int, int], None]], Awaitable[dict[str, Any]]]


@dataclass
class TrainJob:
    """One train call: what it trains (``digest``), its events so far, and whether it has ended."""

    train_id: str
    digest: str
    events: list[Event] = field(default_factory=list)
    done: bool = False
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    def push(self, kind: str, data: dict[str, Any]) -> None:
        self.events.append((kind, data))  # one progress event per micro-batch: few, so all are kept
        self.done = kind in ("result", "error")
        self._changed.set()
        self._changed = asyncio.Event()

    async def follow(self) -> AsyncIterator[Event]:
        """Every event from the first, then new ones as they come, until the result or the error."""
        seen = 0
        while True:
            while seen < len(self.events):
                seen += 1
                yield self.events[seen - 1]
            if self.done:
                return
            await self._changed.wait()


class TrainJobs:
    """The train calls of one server: started once per id, followed by as many requests as ask."""

    def __init__(self) -> None:
        self._jobs: dict[str, TrainJob] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def attach(self, train_id: str, digest: str | None, record_dir: Path) -> tuple[TrainJob | None, str]:
        """The existing call with this id and its state (``running``/``done``), or ``(None, "new")``.

        Raises:
            ConfigError: the id was used for other groups (``digest`` differs); None skips the check.
        """
        job = self._jobs.get(train_id)
        if job is None:
            job = _load_finished(record_dir / f"{train_id}.json", train_id)
            if job is not None:
                self._jobs[train_id] = job
        if job is None:
            return None, "new"
        if digest is not None and job.digest != digest:
            raise ConfigError(f"train id {train_id!r} was already used for other groups or settings: "
                              "each train call needs its own id (the default id is a digest of the groups)")
        return job, "done" if job.done else "running"

    def start(self, train_id: str, digest: str, record_dir: Path, run: Run) -> TrainJob:
        """Start a new call: ``run(progress)`` trains and returns the result's JSON."""
        job = TrainJob(train_id, digest)
        self._jobs[train_id] = job
        loop = asyncio.get_running_loop()

        def progress(done: int, total: int) -> None:  # called from the training thread
            loop.call_soon_threadsafe(job.push, "progress", {"done": done, "total": total})

        async def main() -> None:
            try:
                job.push("result", await run(progress))
            except Exception as exc:  # the call's error goes to its followers, with its class and message
                if not isinstance(exc, ArtError):
                    logger.exception("train call %s failed", train_id)
                job.push("error", {"type": type(exc).__name__, "message": str(exc)})
            if job.events[-1][0] == "result":
                _save_finished(record_dir / f"{train_id}.json", job)
            else:
                del self._jobs[train_id]  # a failed call may be sent again (the error may be transient)

        task = asyncio.create_task(main(), name=f"art-train-{train_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return job

    async def aclose(self) -> None:
        """Wait for the calls still training (a step is not cut in half)."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


def _save_finished(path: Path, job: TrainJob) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"train_id": job.train_id, "digest": job.digest, "result": job.events[-1][1]}),
                   encoding="utf-8")
    os.replace(tmp, path)


def _load_finished(path: Path, train_id: str) -> TrainJob | None:
    if not path.is_file():
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    job = TrainJob(train_id, data["digest"])
    job.push("result", data["result"])
    return job
