"""Rollout workers: async Ray actors that run the user's agent against the gateway, and the pool that feeds them.

The user's rollout function is named by import path, ``"package.module:function"``, so it is imported
on the worker's node (not pickled from the driver). It is called as ``await fn(model, task)``: ``model``
is a ``TrainableModel`` whose gateway is the driver's (its URLs, key and records, reached over HTTP), so
``trainable(graph, model)`` and ``TrainableRunner`` work in the worker unchanged. It returns a
``Trajectory``, which comes back to the driver as JSON.

A worker that dies (its node is lost) takes its rollouts with it: each is counted failed and run again
on another worker, up to ``max_attempts`` times; a rollout that raises in the user's code is counted and
left out of its group (``group.exceptions``), as ``gather_group`` does in one process.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...config import LoraSettings
from ...errors import ConfigError, LifecycleError
from ...types import Trajectory, TrajectoryGroup
from ...wire import RolloutStatus
from .._http import LoopClient
from ..base import ModelSpec

__all__ = ["GatewayView", "RolloutPool", "RolloutStats", "RolloutWorker", "import_rollout"]

logger = logging.getLogger(__name__)

RolloutFn = Callable[[Any, Any], Awaitable[Trajectory]]


def import_rollout(path: str) -> RolloutFn:
    """The function named by ``"package.module:function"``.

    Raises:
        ConfigError: the path is malformed, or the module or function cannot be found.
    """
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"rollout {path!r} is not an import path: write 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"cannot import {module_name!r} for rollout {path!r} on this node: {exc}; install it "
                          "on every node, or pass runtime_env={'py_modules': [...]} to RayBackend") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"{module_name!r} has no function {attr!r} (rollout {path!r})")
    return fn  # type: ignore[no-any-return]


class GatewayView:
    """What a rollout worker's ``TrainableModel`` reaches the driver's gateway through, over HTTP: the adapters'
    ``GatewayAccess`` and nothing more (``model.attach(view, step=...)``; training stays with the driver).

    Args:
        url: the gateway's root URL (``http://host:port``).
        api_key: its bearer token, if it wants one.
        step: the step it serves.
        client: a ``LoopClient`` to fetch records with (its pooled connection is reused across rollouts);
            None: one request on a new connection each time.
    """

    def __init__(self, url: str, api_key: str | None, step: int, client: LoopClient | None = None) -> None:
        self.url, self.key, self.step = url.rstrip("/"), api_key, step
        self.client = client if client is not None else LoopClient(trust_env=False, timeout=60)

    def base_url(self, model: ModelSpec) -> str:
        return f"{self.url}/v1"

    def api_key(self, model: ModelSpec) -> str | None:
        return self.key

    def rollout_base_url(self, model: ModelSpec, rollout_id: str) -> str:
        return f"{self.url}/rollouts/{rollout_id}/v1"

    async def rollout_records(self, model: ModelSpec, rollout_id: str) -> list[Any]:
        from ...gateway.records import ExchangeRecord

        return [ExchangeRecord.model_validate(r) for r in (await self._get(f"/rollouts/{rollout_id}/records")).json()]

    async def rollout_status(self, model: ModelSpec, rollout_id: str) -> RolloutStatus:
        return RolloutStatus.model_validate((await self._get(f"/rollouts/{rollout_id}/status")).json())

    async def _get(self, path: str) -> Any:
        headers = {"Authorization": f"Bearer {self.key}"} if self.key else {}
        async with self.client.client() as client:  # the worker's loop serves its other rollouts meanwhile
            response = await client.get(self.url + path, headers=headers)
        response.raise_for_status()
        return response


class RolloutWorker:
    """Runs one user rollout function, many rollouts at once (an async Ray actor; see the module docstring).

    Args:
        rollout: ``"package.module:function"``.
        gateway_url: the gateway's root URL.
        api_key: its bearer token, if any.
        spec: the model (``ModelSpec`` as a dict).
        step: the step served when the worker starts.
    """

    def __init__(self, *, rollout: str, gateway_url: str, api_key: str | None, spec: dict[str, Any],
                 step: int) -> None:
        self.fn = import_rollout(rollout)
        self.spec = ModelSpec.model_validate(spec)
        self.url, self.api_key = gateway_url, api_key
        self._records = LoopClient(trust_env=False, timeout=60)  # the gateway is ours: no proxy from the environment

    async def run(self, task: Any, step: int) -> dict[str, Any]:
        """One rollout of ``task``; returns the trajectory as JSON (``Trajectory.model_dump(mode="json")``)."""
        from ...model import TrainableModel

        # A model object per rollout (cheap: it holds names), so model.step is the driver's step now.
        model = TrainableModel(name=self.spec.name, project=self.spec.project, base_model=self.spec.base_model,
                               lora=LoraSettings.model_validate(self.spec.lora.model_dump()))
        model.attach(GatewayView(self.url, self.api_key, step, client=self._records), step=step)
        trajectory = await self.fn(model, task)
        if not isinstance(trajectory, Trajectory):
            raise ConfigError(f"the rollout function returned {type(trajectory).__name__}, not a Trajectory")
        return trajectory.model_dump(mode="json")

    async def ping(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()


@dataclass
class RolloutStats:
    """What a ``RolloutPool.gather`` call did."""

    rollouts: int = 0
    """Rollouts asked for."""
    succeeded: int = 0
    failed_lost_worker: int = 0
    """Attempts lost with their worker (each was run again, up to ``max_attempts``)."""
    failed_exception: int = 0
    """Rollouts whose function raised (left out of their group, listed in ``group.exceptions``)."""
    retried: int = 0
    gave_up: int = 0
    """Rollouts still failing after ``max_attempts`` tries (listed in ``group.exceptions``)."""
    per_worker: dict[int, int] = field(default_factory=dict)
    """Successful rollouts per worker index."""


class RolloutPool:
    """Feeds rollouts to worker actors, at most ``per_worker`` at a time on each, retrying lost ones.

    Args:
        make_worker: creates a new worker actor (used at start and to replace dead ones).
        workers: how many workers to keep.
        per_worker: rollouts in flight per worker.
        max_attempts: tries per rollout when workers are lost.
    """

    def __init__(self, make_worker: Callable[[], Any], *, workers: int, per_worker: int = 4,
                 max_attempts: int = 3) -> None:
        if workers < 1 or per_worker < 1 or max_attempts < 1:
            raise ConfigError(f"workers, per_worker and max_attempts must be at least 1, got {workers}, "
                              f"{per_worker}, {max_attempts}")
        self._make = make_worker
        self.workers: list[Any] = [make_worker() for _ in range(workers)]
        self.per_worker = per_worker
        self.max_attempts = max_attempts
        self.stats = RolloutStats()

    async def gather(self, tasks: Sequence[Any], *, n: int, step: int) -> list[TrajectoryGroup]:
        """``n`` rollouts of each task, as one group per task (in order)."""
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, WorkerCrashedError

        lost_errors = (ActorDiedError, ActorUnavailableError, RayActorError, WorkerCrashedError)
        stats = self.stats = RolloutStats(rollouts=len(tasks) * n)
        results: list[list[Trajectory]] = [[] for _ in tasks]
        exceptions: list[list[str]] = [[] for _ in tasks]
        queue: asyncio.Queue[tuple[int, int]] = asyncio.Queue()  # (task index, attempt)
        for ti in range(len(tasks)):
            for _ in range(n):
                queue.put_nowait((ti, 1))
        pending = len(tasks) * n
        done = asyncio.Event()
        if pending == 0:
            return []
        dead: set[int] = set()  # workers known lost: their slots hand their next rollout back and stop

        async def find_dead() -> None:
            # A lost node takes every worker on it at once: ping the others before a lost rollout is retried, so the
            # retry is not spent on a worker that is gone too (with 4 workers on one node, it could be lost 3 times).
            async def ping(wi: int) -> None:
                try:
                    await self.workers[wi].ping.remote()
                except lost_errors:
                    dead.add(wi)

            await asyncio.gather(*(ping(wi) for wi in range(len(self.workers)) if wi not in dead))

        async def slot(wi: int) -> None:
            nonlocal pending
            while not done.is_set():
                # Waits without polling (32 idle slots polling at 50 Hz cost the driver a few % of a core);
                # a retried rollout is put back and wakes one; the slots are cancelled once all are done.
                ti, attempt = await queue.get()
                if wi in dead:
                    queue.put_nowait((ti, attempt))  # not tried: a live worker's slot takes it
                    return
                worker = self.workers[wi]
                try:
                    data = await worker.run.remote(tasks[ti], step)
                except lost_errors as exc:
                    stats.failed_lost_worker += 1
                    dead.add(wi)
                    if attempt < self.max_attempts:
                        stats.retried += 1
                        await find_dead()
                        queue.put_nowait((ti, attempt + 1))
                    else:
                        stats.gave_up += 1
                        exceptions[ti].append(f"lost worker, {attempt} attempts: {exc}")
                        pending -= 1
                        if pending == 0:
                            done.set()
                    logger.warning("rollout worker %d lost (%s); its rollout is retried elsewhere", wi, type(exc).__name__)
                    return  # this worker is gone: its slots stop taking work
                except Exception as exc:
                    stats.failed_exception += 1
                    exceptions[ti].append(f"{type(exc).__name__}: {exc}")
                    pending -= 1
                else:
                    results[ti].append(Trajectory.model_validate(data))
                    stats.succeeded += 1
                    stats.per_worker[wi] = stats.per_worker.get(wi, 0) + 1
                    pending -= 1
                if pending == 0:
                    done.set()

        slots = [asyncio.create_task(slot(wi)) for wi in range(len(self.workers)) for _ in range(self.per_worker)]
        watcher = asyncio.create_task(done.wait())
        try:
            while not done.is_set():
                alive = [s for s in slots if not s.done()]
                if not alive:
                    break
                await asyncio.wait([*alive, watcher], return_when=asyncio.FIRST_COMPLETED)
                for s in slots:
                    if s.done() and not s.cancelled() and s.exception() is not None:
                        raise s.exception()  # type: ignore[misc]
            if not done.is_set():
                raise LifecycleError(f"every rollout worker was lost with {pending} rollout(s) left: "
                                     "add nodes, or RayBackend(rollout_workers=...) more workers")
        finally:
            watcher.cancel()
            for s in slots:
                s.cancel()
        await self._replace_dead()
        return [TrajectoryGroup(trajectories, exceptions=errors) for trajectories, errors in zip(results, exceptions)]

    async def _replace_dead(self) -> None:
        """Start a new worker for each one whose node is gone, so the next gather has the full pool."""
        for wi, worker in enumerate(self.workers):
            try:
                async with asyncio.timeout(30):  # not wait_for: on 3.11 it can swallow a cancellation
                    await worker.ping.remote()
            except Exception:  # any failure to answer: replace it
                self.workers[wi] = self._make()
